//! Code both weft agents need, written once: today their common
//! configuration; with the agent protocol, the controller session
//! (enrollment, watch, report, backoff); with the data plane, the Linux
//! reconciler. Nothing here is specific to nodes or gateways.

pub mod config;
