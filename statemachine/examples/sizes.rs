use allot_statemachine::*;
fn main() {
    println!("AuditEvent {}", std::mem::size_of::<AuditEvent>());
    println!("EventBody {}", std::mem::size_of::<EventBody>());
    println!("Command {}", std::mem::size_of::<Command>());
    println!("Outcome {}", std::mem::size_of::<Outcome>());
    println!("Reply {}", std::mem::size_of::<Reply>());
    println!("CommandError {}", std::mem::size_of::<CommandError>());
    println!("Request {}", std::mem::size_of::<Request>());
    println!("Hold {}", std::mem::size_of::<ledger::Hold>());
    println!("Bucket {}", std::mem::size_of::<ledger::Bucket>());
}
