//! The example traces of evidence arms ([`super::latest_traces`], one walk down an agent's
//! requests for all the labels) are those of the statement the analytics ran per label before
//! (kept here as the reference): for each label, the latest traced request of the agent in the
//! window whose model, provider or env is the label. On SQLite and PostgreSQL, on seeded
//! random records (traced and not, other agents', before the window, several in one
//! millisecond) and labels no request names.

use std::collections::BTreeMap;

use nm_types::record::{RequestRecord, TraceRef};
use sea_orm::ConnectionTrait;

use super::synthetic::Rng;
use super::{latest_trace_statement, latest_traces};
use crate::scratch::{ScratchPg, drop_test_db};
use crate::sql::Sql;
use crate::store::Store;
use crate::{Budgets, Records};

const T0: i64 = 1_800_000_000_000;
const SINCE: i64 = T0 - 30 * 86_400_000;

const MODELS: [&str; 4] = ["m-1", "m-2", "m-3", "openai"];
const PROVIDERS: [&str; 2] = ["openai", "anthropic"];
const ENVS: [&str; 3] = ["production", "staging", "development"];

/// Labels of every kind an arm has: models, providers and envs (one model shares its name with
/// a provider), weeks, bands, a model only another agent used, one only used before the
/// window, and one no request names.
fn labels() -> Vec<String> {
    let mut l: Vec<String> = MODELS
        .iter()
        .chain(&PROVIDERS)
        .chain(&ENVS)
        .map(|s| (*s).to_owned())
        .collect();
    l.extend(
        [
            "2027-01-11",
            "ttfb < 1s",
            "other-model",
            "old-model",
            "nobody",
        ]
        .map(str::to_owned),
    );
    l
}

/// Seeded records of agent `a` (and some of `b`): a share `traced` of them traced; times
/// drawn from few enough milliseconds that some share one.
fn records(seed: u64, n: usize, traced: f64) -> Vec<RequestRecord> {
    let mut rng = Rng::new(seed);
    let pick = |rng: &mut Rng, items: &[&str]| -> String {
        items[rng.below(items.len() as u64) as usize].to_owned()
    };
    (0..n)
        .map(|i| {
            let other = rng.chance(0.2);
            let old = rng.chance(0.05);
            let started_at_ms = if old {
                SINCE - 1 - rng.below(86_400_000) as i64
            } else {
                SINCE + rng.below(3_000) as i64 * 864_000
            };
            let model = if other {
                "other-model".to_owned()
            } else if old {
                "old-model".to_owned()
            } else {
                pick(&mut rng, &MODELS)
            };
            let trace = rng.chance(traced).then(|| {
                let mut id = [0u8; 16];
                id[..8].copy_from_slice(&(i as u64).to_be_bytes());
                id[8..].copy_from_slice(&seed.to_be_bytes());
                TraceRef {
                    trace_id: id,
                    span_id: [1; 8],
                }
            });
            RequestRecord {
                request_id: format!("{i:08x}-{seed:04x}-7000-8000-000000000000"),
                started_at_ms,
                key_id: "k".into(),
                provider: pick(&mut rng, &PROVIDERS).into(),
                method: "POST".into(),
                path: "/v1/chat/completions".to_owned(),
                model: rng.chance(0.95).then_some(model),
                agent: Some(if other { "b" } else { "a" }.to_owned()),
                env: rng
                    .chance(0.9)
                    .then(|| pick(&mut rng, &ENVS).parse().unwrap()),
                status: 200,
                trace,
                ..RequestRecord::default()
            }
        })
        .collect()
}

/// The statement of the analytics before: one label's latest traced request. Returns its
/// time and the traces of every such request of that millisecond (any of them is right).
async fn reference(store: &Store, label: &str) -> Option<(i64, Vec<String>)> {
    let db = store.conn();
    let mut sql = Sql::new(
        db.get_database_backend(),
        "SELECT started_at_ms FROM requests WHERE trace_id IS NOT NULL AND agent = 'a' \
         AND started_at_ms >= ",
    );
    sql.bind(SINCE)
        .push(" AND (model = ")
        .bind(label.to_owned())
        .push(" OR provider = ")
        .bind(label.to_owned())
        .push(" OR env = ")
        .bind(label.to_owned())
        .push(") ORDER BY started_at_ms DESC LIMIT 1");
    let at: i64 = db
        .query_one_raw(sql.build())
        .await
        .unwrap()?
        .try_get("", "started_at_ms")
        .unwrap();
    let mut sql = Sql::new(
        db.get_database_backend(),
        "SELECT trace_id FROM requests WHERE trace_id IS NOT NULL AND agent = 'a' \
         AND started_at_ms = ",
    );
    sql.bind(at)
        .push(" AND (model = ")
        .bind(label.to_owned())
        .push(" OR provider = ")
        .bind(label.to_owned())
        .push(" OR env = ")
        .bind(label.to_owned())
        .push(")");
    let traces = db
        .query_all_raw(sql.build())
        .await
        .unwrap()
        .iter()
        .map(|r| r.try_get::<String>("", "trace_id").unwrap())
        .collect();
    Some((at, traces))
}

async fn check(url: &str) {
    let store = Store::connect(url).await.unwrap();
    let records_store = Records::new(
        store.clone(),
        Budgets::load(store.clone(), T0).await.unwrap(),
    );
    for (seed, traced) in [(1, 0.0), (2, 0.01), (3, 0.3), (4, 1.0)] {
        let batch = records(seed, 3_000, traced);
        for chunk in batch.chunks(500) {
            records_store.ingest(chunk).await.unwrap();
        }
        let found = latest_traces(&store, "a", SINCE, labels()).await.unwrap();
        let mut expected = BTreeMap::new();
        for label in labels() {
            let want = reference(&store, &label).await;
            match (&want, found.get(&label)) {
                (None, None) => {}
                (Some((_, traces)), Some(got)) => assert!(
                    traces.contains(got),
                    "seed {seed}, {label}: {got} is not among {traces:?}"
                ),
                _ => panic!(
                    "seed {seed}, {label}: reference {want:?}, walk {:?}",
                    found.get(&label)
                ),
            }
            expected.insert(label, want.is_some());
        }
        // The labels no traced request of `a` in the window names get nothing.
        for label in [
            "2027-01-11",
            "ttfb < 1s",
            "other-model",
            "old-model",
            "nobody",
        ] {
            assert!(!found.contains_key(label), "seed {seed}, {label}");
        }
        if traced > 0.0 {
            assert!(
                expected["m-1"] && expected["production"],
                "seed {seed}: traced labels"
            );
        }
    }
    store.close().await.unwrap();
}

#[tokio::test]
async fn one_walk_finds_each_labels_latest_trace_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    check(&format!("sqlite://{}/t.db?mode=rwc", dir.path().display())).await;
}

#[tokio::test]
async fn one_walk_finds_each_labels_latest_trace_postgres() {
    let Some(pg) = ScratchPg::for_tests().await else {
        return;
    };
    check(&pg.url).await;
    drop_test_db(&pg.url).await;
}

/// SQLite reads the walk through the partial index of traced requests (m0019), not the index of
/// all the agent's requests: with nothing traced it has nothing to read.
#[tokio::test]
async fn the_walk_reads_the_index_of_traced_requests_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::connect(&format!("sqlite://{}/t.db?mode=rwc", dir.path().display()))
        .await
        .unwrap();
    let db = store.conn();
    let statement = latest_trace_statement(
        db.get_database_backend(),
        "a",
        SINCE,
        i64::MAX,
        &["m-1".to_owned(), "openai".to_owned()],
    );
    let detail = crate::sql::query_plan(db, &statement).await;
    assert!(
        detail
            .iter()
            .any(|d| d.contains("INDEX idx_requests_agent_traced")),
        "{detail:?}"
    );
}
