//! weft's site controller around its pure core (`weft-core`: domain, IPAM,
//! configuration, render; re-exported here under the same names).
//!
//! Layers, from the inside out: `store` is the key-value abstraction with
//! its etcd and embedded backends; `state` keeps the controller's records in
//! a store with transactions; `hub` streams each agent its desired state;
//! `grpc` and `federation` implement the weft.v1 services and convert
//! between prost and domain types; `server` and `cli` wire it together. The
//! binary's `main` is one line. No two modules import each other, directly
//! or around a loop (checked by `tests/e2e/layers.rs`, which also checks
//! what each crate links).

pub mod admission;
pub mod auth;
pub mod backup;
pub mod ca;
pub mod cli;
pub mod config;
pub mod diagnose;
pub mod error;
pub mod federation;
pub mod grpc;
pub mod hub;
pub mod leader;
pub mod metrics;
pub mod pki;
pub mod reflector;
pub mod refused;
pub mod server;
pub mod state;
pub mod store;

pub use weft_core::{domain, export, ipam, names, render, transit};
