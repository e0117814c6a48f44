//! The request builders of the benchmarks, tests and demo, which live with the state
//! machine's test data (`allot_statemachine::workload`) so its own benchmarks use them
//! too.

pub use allot_statemachine::workload::*;
