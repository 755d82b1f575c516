//! Partition log.
