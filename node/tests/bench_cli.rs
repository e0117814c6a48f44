//! `allot-bench`'s own bad flags are a usage error (exit 2) before anything starts.

use std::process::Command;

#[test]
fn bad_flags_are_a_usage_error() {
    let bench = env!("CARGO_BIN_EXE_allot-bench");
    for bad in [
        &["--bogus"][..],
        &["--seconds"],
        &["--per-call", "0"],
        &["--rate", "10", "--vs-etcd"],
        &["--window", "5"],
    ] {
        let out = Command::new(bench).args(bad).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("usage: allot-bench"), "{bad:?}: {err}");
    }
    let help = Command::new(bench).arg("--help").output().unwrap();
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).contains("--vs-etcd"));
}
