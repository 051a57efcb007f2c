//! The export group's placement: it runs alone, on its own topic.

use demo_groups::export::check_runs_alone;

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn the_export_group_runs_alone_on_its_own_topic() {
    let export_topic = names(&["export-jobs"]);
    assert!(check_runs_alone(&names(&["export"]), &export_topic).is_ok());
    assert!(check_runs_alone(
        &names(&["inventory", "notification"]),
        &names(&["order-events"])
    )
    .is_ok());
    let mixed = check_runs_alone(&names(&["export", "inventory"]), &export_topic);
    assert!(mixed.is_err_and(|e| e.to_string().contains("not beside inventory")));
    assert!(check_runs_alone(&names(&["export"]), &names(&["order-events"])).is_err());
}
