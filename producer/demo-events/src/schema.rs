//! The demonstration's tables and its single database's migrations.

use std::sync::LazyLock;

use outbox::MIGRATOR as OUTBOX_MIGRATOR;
use sqlx::migrate::Migrator;

/// The consumer library's tables (`migrations/consumer`), as the `consumer` library applies
/// them.
pub static CONSUMER_MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/consumer")
};

/// The order service's tables: catalogue, orders, order lines, export jobs
/// (`migrations/demo-orders`).
pub static DEMO_ORDERS_MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/demo-orders")
};

/// The demo groups' effect tables: inventory and notification (`migrations/demo-groups`).
pub static DEMO_GROUPS_MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../../migrations/demo-groups")
};

/// The order service's schema: the outbox's tables and its own.
pub const ORDER_SERVICE: [&Migrator; 2] = [&OUTBOX_MIGRATOR, &DEMO_ORDERS_MIGRATOR];

/// The demo groups' schema: the consumer library's tables and the groups' effect tables.
pub const DEMO_GROUPS: [&Migrator; 2] = [&CONSUMER_MIGRATOR, &DEMO_GROUPS_MIGRATOR];

/// Every set in one, for the demonstration's single database (the order service, the relay and
/// the groups share it) and for tests.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let migrations = [
        &OUTBOX_MIGRATOR,
        &CONSUMER_MIGRATOR,
        &DEMO_ORDERS_MIGRATOR,
        &DEMO_GROUPS_MIGRATOR,
    ]
    .iter()
    .flat_map(|m| m.migrations.iter().cloned())
    .collect::<Vec<_>>();
    Migrator {
        migrations: std::borrow::Cow::Owned(migrations),
        ignore_missing: true,
        ..Migrator::DEFAULT
    }
});
