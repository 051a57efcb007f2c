//! Nothing to use: this crate's dependencies carry the features the tests' dev-dependencies turn
//! on, so that every `--workspace` build unifies to them (see its Cargo.toml).
