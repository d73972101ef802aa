//! Code both weft agents need, written once: their configuration, their
//! identity (enrollment with a token, a key that never leaves the host,
//! renewal), the desired-state session with the controller, the guard that
//! refuses what reaches past weft, tunnel probes, metrics, and the applier
//! on top of the data plane (`weft-dataplane`). Nothing here is specific to
//! nodes or gateways.

pub mod apply;
pub mod config;
pub mod desired;
pub mod discovery;
pub mod dns;
pub mod fallback;
pub mod guard;
pub mod identity;
pub mod linux;
pub mod metrics;
pub mod probe;
pub mod relay;
pub mod run;
pub mod session;
pub mod tls_relay;
pub mod wgkey;

pub use weft_common::tls;
