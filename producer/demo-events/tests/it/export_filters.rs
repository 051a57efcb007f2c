//! An export job's filters as the job's JSON carries them.

use demo_events::export_events::ExportFilters;
use demo_events::order_events::OrderStatus;

#[test]
fn filters_round_trip_and_refuse_unknown_fields() {
    let filters = ExportFilters {
        status: Some(OrderStatus::Paid),
        customer_id: Some("c-1".into()),
        ..ExportFilters::default()
    };
    let json = serde_json::to_value(&filters).expect("serialise");
    assert_eq!(
        json,
        serde_json::json!({"status": "paid", "customer_id": "c-1"})
    );
    assert_eq!(
        serde_json::from_value::<ExportFilters>(json).expect("parse"),
        filters
    );
    assert!(serde_json::from_value::<ExportFilters>(serde_json::json!({"colour": 1})).is_err());
}
