//! One module per command.

pub mod allocations;
pub mod diagnose;
pub mod gateways;
pub mod names;
pub mod nodes;
pub mod peerings;
pub mod policy;
pub mod site;
pub mod status;
pub mod test_network;
pub mod tokens;
pub mod topology;
pub mod ui;
pub mod version;
