//! The controller's pure core: the domain (sites, agents, peerings), IPAM,
//! names, the enrollment and peer-validation decisions, and the render from
//! records to each agent's desired objects (the
//! controller's configuration, flags and file, is the controller's). No store, no tonic, no I/O: everything here is
//! a function of its inputs and is tested as such.

pub mod domain;
pub mod enroll;
pub mod export;
pub mod ipam;
pub mod names;
pub mod nat;
pub mod peer;
pub mod relay;
pub mod render;
pub mod transit;
