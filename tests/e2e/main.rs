//! The end-to-end suite: one test binary, a module per area. The tests that
//! need root are #[ignore]d for a plain `cargo test`; tests/run.sh runs them.

mod addressing;
mod admin_api;
mod agent_enrollment;
mod backup;
mod bad_input;
mod config_errors;
mod crash_consistency;
mod dataplane;
mod diagnose;
mod dual_stack;
mod exports;
mod failover;
mod faults;
mod federation;
mod federation_updates;
mod flood;
mod full_disk;
mod guard;
mod hosts;
mod identity;
mod layers;
mod load;
mod mesh;
mod names;
mod nat_traversal;
mod observability;
mod policy;
mod replicas;
mod restart;
mod state_ipam;
mod store_conformance;
mod transit;
mod vm;
mod watch;
mod wg_device;
