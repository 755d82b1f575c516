//! The Rust client: the CLI uses only this.
//!
//! - [`admin`]: topics and cluster state;
//! - [`controller`]: the broker's side of the broker lifecycle API;
//! - [`connection`]: bootstrap lists, channels, and the shared retry loop.

pub mod admin;
pub mod connection;
pub mod controller;
pub mod error;

pub use admin::AdminClient;
pub use error::ClientError;
