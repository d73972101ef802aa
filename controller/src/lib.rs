//! weft's site controller: configuration, IPAM, the state store and the
//! gRPC services, plus the admin CLI.
//!
//! Layers, from the inside out: `config`, `domain` and `ipam` are pure logic
//! (no tonic, no store); `store` is the key-value abstraction with its etcd
//! and embedded backends; `state` keeps the controller's records in a store
//! with transactions; `grpc` implements the weft.v1 services and converts
//! between prost and domain types; `server` and `cli` wire it together and
//! `weftctl` is the admin client. The binaries' `main`s are one line.

pub mod admission;
pub mod auth;
pub mod cli;
pub mod client;
pub mod config;
pub mod diagnose;
pub mod domain;
pub mod error;
pub mod federation;
pub mod grpc;
pub mod hub;
pub mod ipam;
pub mod leader;
pub mod metrics;
pub mod pki;
pub mod render;
pub mod server;
pub mod state;
pub mod store;
pub mod weftctl;
