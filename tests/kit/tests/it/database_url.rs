//! The kit's database URLs: a test's database replaces the server URL's, and the rest stays.

use pipeline_testkit::db::with_database;

#[test]
fn replaces_the_database_and_keeps_the_query() {
    assert_eq!(
        with_database("postgres://u@h:5432/postgres", "x"),
        "postgres://u@h:5432/x"
    );
    assert_eq!(
        with_database("postgres://u@h/postgres?sslmode=disable", "x"),
        "postgres://u@h/x?sslmode=disable"
    );
    assert_eq!(with_database("postgres://u@h", "x"), "postgres://u@h/x");
}
