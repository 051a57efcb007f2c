//! The demonstration product catalogue: `sku-00001` … `sku-N`, each with a name and a price.
//!
//! Seeding is an upsert, so running it again (or with a larger N) is safe, and the inventory
//! consumer seeds its stock from the same ids (`demo_product_id`).

use anyhow::Context;
use demo_events::order_events::demo_product_id;
use pipeline_core::db::DbArgs;
use pipeline_core::telemetry::LogArgs;
use sqlx::PgPool;

/// Rows written per statement.
const BATCH: u32 = 1_000;

/// `producer seed-catalog`: create or update the demonstration products.
#[derive(clap::Args, Debug)]
pub struct SeedCatalogArgs {
    /// Number of products to create or update: sku-00001 … sku-N.
    #[arg(
        long,
        env = "CATALOG_PRODUCTS",
        default_value_t = 100,
        value_parser = clap::value_parser!(u32).range(1..=1_000_000)
    )]
    pub products: u32,
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

/// One product of the demonstration catalogue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoProduct {
    pub product_id: String,
    pub name: String,
    pub price_cents: i64,
}

/// The `n`th demonstration product (1-based). Its price is fixed by `n`, between 1.00 and 99.99.
pub fn demo_product(n: u32) -> DemoProduct {
    DemoProduct {
        product_id: demo_product_id(n),
        name: format!("Demo product {n}"),
        price_cents: 100 + i64::from(n.wrapping_mul(7_919) % 9_900),
    }
}

/// Upserts products 1 to `products` in one transaction. Returns how many rows were created or
/// changed (0 when the catalogue was already seeded).
pub async fn seed_catalog(pool: &PgPool, products: u32) -> Result<u64, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let mut changed = 0;
    let mut start = 1;
    while start <= products {
        let end = products.min(start.saturating_add(BATCH - 1));
        let batch: Vec<DemoProduct> = (start..=end).map(demo_product).collect();
        let ids: Vec<&str> = batch.iter().map(|p| p.product_id.as_str()).collect();
        let names: Vec<&str> = batch.iter().map(|p| p.name.as_str()).collect();
        let prices: Vec<i64> = batch.iter().map(|p| p.price_cents).collect();
        changed += sqlx::query(
            "INSERT INTO product (product_id, name, price_cents)
             SELECT * FROM unnest($1::text[], $2::text[], $3::int8[])
             ON CONFLICT (product_id) DO UPDATE
                SET name = EXCLUDED.name, price_cents = EXCLUDED.price_cents
                WHERE (product.name, product.price_cents)
                      IS DISTINCT FROM (EXCLUDED.name, EXCLUDED.price_cents)",
        )
        .bind(&ids)
        .bind(&names)
        .bind(&prices)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        start = match end.checked_add(1) {
            Some(next) => next,
            None => break,
        };
    }
    tx.commit().await?;
    Ok(changed)
}

/// Runs `producer seed-catalog`.
pub async fn run(args: SeedCatalogArgs) -> anyhow::Result<()> {
    tracing::info!(db = ?args.db, products = args.products, "seeding catalogue");
    let pool = args.db.connect(&crate::SCHEMA).await?;
    let changed = seed_catalog(&pool, args.products)
        .await
        .context("seeding the product catalogue")?;
    tracing::info!(
        products = args.products,
        changed,
        "catalogue seeded: {} products, {changed} created or changed",
        args.products
    );
    pool.close().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_products_are_stable_and_priced() {
        assert_eq!(demo_product(1), demo_product(1));
        assert_eq!(demo_product(7).product_id, "sku-00007");
        for n in 1..=2_000 {
            let price = demo_product(n).price_cents;
            assert!((100..10_000).contains(&price), "{n}: {price}");
        }
    }
}
