//! Topic config.
