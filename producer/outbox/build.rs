//! Rebuilds the crate when a migration is added: `sqlx::migrate!` embeds the migration files
//! at compile time, and cargo would not otherwise notice a new file in their directory.

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
