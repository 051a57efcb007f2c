//! The demonstration's contract and tables (one test binary, each file beside this one a module).

mod export_filters;
mod migrations;
