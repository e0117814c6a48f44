//! `allot-jepsen`: the fault-injection harness. Empty until the harness issue lands.
