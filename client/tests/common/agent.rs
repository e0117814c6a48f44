//! The `allot-agent` binary as a child process of a test.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The `allot-agent` binary as a child process, logging to `<dir>/agent.log`. Stopped
/// with SIGTERM when dropped; its log is printed if the test is failing (or
/// ALLOT_TEST_AGENT_LOG is set).
pub struct AgentProc {
    child: Option<Child>,
    pub log: PathBuf,
}

/// Which node an agent runs, and how.
pub struct AgentSpec<'a> {
    pub endpoints: &'a [String],
    pub shard: u32,
    pub node: u64,
    pub gpus: u32,
    /// Its work directory is `<dir>/work`, its log `<dir>/agent.log`.
    pub dir: &'a Path,
    pub extra: &'a [&'a str],
    /// Variables set in the agent's environment.
    pub env: &'a [(&'a str, &'a str)],
}

impl AgentProc {
    pub fn spawn(s: AgentSpec) -> AgentProc {
        std::fs::create_dir_all(s.dir).unwrap();
        let log = s.dir.join("agent.log");
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_allot-agent"))
            .arg("--endpoints")
            .arg(s.endpoints.join(","))
            .args([
                "--shard",
                &s.shard.to_string(),
                "--node",
                &s.node.to_string(),
            ])
            .args(["--gpu-type", "A100", "--gpus", &s.gpus.to_string()])
            .args([
                "--mem-gb",
                "80",
                "--label",
                "zone=test",
                "--label",
                "rack=r1",
            ])
            .args(["--node-heartbeat-interval", "1s", "-vv"])
            .arg("--work-dir")
            .arg(s.dir.join("work"))
            .args(s.extra)
            .env_remove("RUST_LOG")
            .env_remove("ALLOT_AGENT_TOKEN")
            .env_remove("ALLOT_AGENT_REGISTER_TOKEN")
            .envs(s.env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        AgentProc {
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL, at once (the agent gets no chance to stop its runners).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits for the exit (SIGKILL after `within`: `None`).
    pub fn stop(&mut self, within: Duration) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The exit status, if the agent has exited (it is reaped then).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().unwrap())
    }

    /// Sends `signal` (a `kill -<signal>` name: STOP, CONT, ...) to the agent itself.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid().expect("the agent runs");
        let st = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(st.success(), "kill -{signal} {pid}");
    }

    pub fn assert_running(&mut self) {
        if let Some(st) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
            panic!("the agent exited: {st}");
        }
    }

    /// The agent's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(15));
        if std::thread::panicking() || std::env::var_os("ALLOT_TEST_AGENT_LOG").is_some() {
            if let Ok(f) = std::fs::File::open(&self.log) {
                let lines: Vec<String> = BufReader::new(f).lines().map_while(Result::ok).collect();
                eprintln!(
                    "---- agent log {} (last 200 lines) ----",
                    self.log.display()
                );
                for l in lines.iter().rev().take(200).rev() {
                    eprintln!("{l}");
                }
            }
        }
    }
}
