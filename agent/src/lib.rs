//! Code both weft agents need, written once: their configuration, their
//! identity (enrollment with a token, a key that never leaves the host,
//! renewal), TLS toward the controller, and the main loop. With the agent
//! protocol, the desired-state session joins it; with the data plane, the
//! Linux reconciler. Nothing here is specific to nodes or gateways.

pub mod apply;
pub mod config;
pub mod desired;
pub mod guard;
pub mod identity;
pub mod linux;
pub mod metrics;
pub mod offload;
pub mod probe;
pub mod run;
pub mod tls;
pub mod wgkey;
pub mod wireguard;
