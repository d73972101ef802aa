//! The controller's pure core: the domain (sites, agents, peerings), IPAM,
//! the configuration's validation and the render from records to each
//! agent's desired objects. No store, no tonic, no I/O: everything here is
//! a function of its inputs and is tested as such.

pub mod config;
pub mod domain;
pub mod ipam;
pub mod names;
pub mod render;
