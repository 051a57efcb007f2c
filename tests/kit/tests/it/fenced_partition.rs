//! A partition task fenced while its partition stays assigned to its member. During a rebalance
//! another member's task can take a partition's ownership token (its claim replaces the token)
//! and then lose the partition again, so the partition stays with the first member while that
//! member's task finds its next batch refused and stops. The member must fetch what the stopped
//! task left undone again and apply it with a new task: every event, those published after the
//! fence included, applied exactly once and in order, and the group's lag back to zero, not left
//! waiting for the next rebalance.

use std::time::Duration;

use pipeline_testkit::effects::assert_exactly_once_in_order;
use pipeline_testkit::TestEnv;

const GROUPS: [&str; 2] = ["inventory", "notification"];
const PRODUCTS: u32 = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_task_leaves_nothing_behind_on_its_partition() -> anyhow::Result<()> {
    // One partition: each group's member has one task, and every event goes through it.
    let env = TestEnv::new("fenced", 1).await?;
    env.seed_catalog(PRODUCTS)?;
    env.seed_stock(PRODUCTS, Some(1_000_000))?;
    let (_order_service, url) = env.order_service().await?;
    let (_relay, _) = env.relay("relay").await?;
    let (_consumer, _) = env.consumer("consumer").await?;
    env.place_orders(&url, 20, PRODUCTS, 1)?;
    env.wait_drained(&GROUPS, Duration::from_secs(60)).await?;

    // Both groups' tasks fenced, as another member's claim fences them.
    let fenced = sqlx::query(
        "UPDATE partition_owner SET owner = gen_random_uuid() WHERE group_name = ANY($1)",
    )
    .bind(vec![env.group("inventory"), env.group("notification")])
    .execute(&env.pool)
    .await?
    .rows_affected();
    assert_eq!(fenced, 2, "one owned partition per group");

    env.place_orders(&url, 20, PRODUCTS, 2)?;
    env.wait_drained(&GROUPS, Duration::from_secs(60)).await?;
    assert_exactly_once_in_order(&env, &GROUPS).await?;
    Ok(())
}

/// The same fence while the partition's fetch is paused because its task has too much queued:
/// the task stops with its fetch paused, and nothing is left to resume it but the task that
/// takes its place. Every event is still applied, without waiting for a rebalance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_fenced_while_its_fetch_is_paused_leaves_its_partition_fetching(
) -> anyhow::Result<()> {
    let env = TestEnv::new("fenced-paused", 1).await?;
    env.seed_catalog(PRODUCTS)?;
    env.seed_stock(PRODUCTS, Some(1_000_000))?;
    let (_order_service, url) = env.order_service().await?;
    let (_relay, _) = env.relay("relay").await?;
    let args = ["--max-queued", "20", "--max-batch", "10"];
    let (_consumer, _) = env.consumer_with_args("consumer", &args).await?;
    env.place_orders(&url, 5, PRODUCTS, 1)?;
    env.wait_drained(&GROUPS, Duration::from_secs(60)).await?;

    // The groups' batches wait on the dedupe table while more than `--max-queued` events reach
    // each task: its partition's fetch is paused.
    let mut blocker = env.pool.begin().await?;
    let _ = sqlx::query("LOCK TABLE processed_message IN EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await?;
    env.place_orders(&url, 30, PRODUCTS, 2)?;
    pipeline_testkit::wait_until(
        "the relay published the new orders",
        Duration::from_secs(60),
        || async {
            let pending: i64 = sqlx::query_scalar(pipeline_testkit::db::UNPUBLISHED_SQL)
                .fetch_one(&env.pool)
                .await?;
            Ok((pending == 0).then_some(()))
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Both tasks fenced while their batch waits; the batch then goes on and the next is refused.
    let pool = env.pool.clone();
    let groups = vec![env.group("inventory"), env.group("notification")];
    let fence = tokio::spawn(async move {
        sqlx::query(
            "UPDATE partition_owner SET owner = gen_random_uuid() WHERE group_name = ANY($1)",
        )
        .bind(groups)
        .execute(&pool)
        .await
        .map(|r| r.rows_affected())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    blocker.rollback().await?;
    assert_eq!(fence.await??, 2, "one owned partition per group");

    env.wait_drained(&GROUPS, Duration::from_secs(60)).await?;
    assert_exactly_once_in_order(&env, &GROUPS).await?;
    Ok(())
}
