// The web console end to end, in headless Chromium (Debian's /usr/bin/chromium) driven by
// playwright-core, against the real stack that tests/kit/tests/it/console.rs starts: it passes the
// console's URL, the users' credentials and the orders it prepared in the environment.
//
//   CONSOLE_URL     the console's address with its path prefix (`http://127.0.0.1:PORT/ops`):
//                   every page is visited, and every link, form, stylesheet and script checked,
//                   under that prefix
//   ORDER_SERVICE_URL
//   OPERATOR_USER, OPERATOR_PASSWORD, VIEWER_USER, VIEWER_PASSWORD
//   DEAD_ORDER      an order whose first event the inventory group dead-lettered (its cause
//                   since fixed), its later events parked behind it
//   FAILED_ORDER, FAILED_EVENT   an order whose first event failed in the outbox for good
//   PAUSE_GROUP     a group to pause and resume (when the console offers it)
//   SCREENSHOT_DIR  where the screenshots go (printed)
//
// Run by `node --test console.test.mjs` (npm test).

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import path from "node:path";
import fs from "node:fs";
import { chromium } from "playwright-core";

const env = (name, fallback) => {
  const v = process.env[name] ?? fallback;
  if (v === undefined) throw new Error(`${name} is not set: run this through tests/kit/tests/console.rs`);
  return v;
};
const URL_BASE = env("CONSOLE_URL").replace(/\/$/, "");
/// The console's path prefix (empty at the root).
const PREFIX = new URL(URL_BASE).pathname.replace(/\/$/, "");
/// The URL of the console's `path` (`/` is the overview: the prefix itself).
const at = (path) => (path === "/" && PREFIX ? URL_BASE : URL_BASE + path);
const ORDER_SERVICE = env("ORDER_SERVICE_URL", "");
const SHOTS = env("SCREENSHOT_DIR", fs.mkdtempSync("/tmp/console-shots-"));
const DEADLINE_MS = 90_000;

let browser;

before(async () => {
  fs.mkdirSync(SHOTS, { recursive: true });
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
  });
});

after(async () => {
  await browser?.close();
});

async function newPage() {
  const context = await browser.newContext({ viewport: { width: 1400, height: 1000 } });
  const page = await context.newPage();
  // Any script error or CSP violation on a page fails the test.
  const problems = [];
  page.on("pageerror", (e) => problems.push(String(e)));
  page.on("console", (m) => {
    if (m.type() === "error") problems.push(m.text());
  });
  page.problems = problems;
  return page;
}

async function login(page, user, password) {
  await page.goto(at("/"));
  assert.ok(page.url().startsWith(at("/login?next=")), `the login form under the prefix: ${page.url()}`);
  await page.fill('input[name="user"]', user);
  await page.fill('input[name="password"]', password);
  await page.click('button[type="submit"]');
}

/// Asserts that every link, form, stylesheet and script of the page, and the URLs its script
/// fetches, are the console's own: under the prefix.
async function assertInside(page) {
  const urls = await page.$$eval("a[href], link[href], script[src], form[action], [data-api], [data-login]", (nodes) =>
    nodes.flatMap((n) => ["href", "src", "action", "data-api", "data-login"].map((a) => n.getAttribute(a)).filter((v) => v !== null)));
  assert.ok(urls.length >= 3, `${page.url()}: ${urls}`);
  for (const url of urls) {
    const inside = PREFIX ? url === PREFIX || url.startsWith(PREFIX + "/") : url.startsWith("/") && !url.startsWith("//");
    assert.ok(inside, `${page.url()}: ${url} is outside ${PREFIX}`);
  }
}

/// Reloads the console's `url` until `check(page)` is true, or fails after the deadline.
async function until(page, url, what, check) {
  const deadline = Date.now() + DEADLINE_MS;
  for (;;) {
    await page.goto(at(url));
    if (await check(page)) return;
    if (Date.now() > deadline) assert.fail(`${what}: not within ${DEADLINE_MS / 1000}s`);
    await page.waitForTimeout(1000);
  }
}

async function timelineRows(page, place) {
  return page.$$eval(`#timeline tr.step[data-place="${place}"]`, (rows) =>
    rows.map((r) => ({ what: r.dataset.transition, seq: r.cells[3].textContent.trim(), detail: r.cells[6].textContent })));
}

/// Fills the page's first action form: the note, the confirmation, then its button.
async function act(page, note) {
  const form = page.locator("form.action").first();
  await form.locator("input.note").fill(note);
  await form.locator('input[name="confirm"]').check();
  await form.locator("button.act").click();
}

async function shot(page, name) {
  const file = path.join(SHOTS, name);
  await page.screenshot({ path: file, fullPage: true });
  console.log(`screenshot: ${file}`);
}

async function lagOf(page, group) {
  const data = await page.evaluate(async (url) => (await fetch(url)).json(), at("/api/overview"));
  const g = data.status?.groups.find((x) => x.group === group);
  return { lag: g?.lag_messages ?? null, state: g?.state ?? null, readAt: data.read_at };
}

test("a wrong password is refused", async () => {
  const page = await newPage();
  await login(page, env("OPERATOR_USER"), "not-the-password");
  assert.match(page.url(), /\/login/);
  await page.waitForSelector("text=Wrong user name or password");
  const cookies = await page.context().cookies();
  assert.equal(cookies.length, 0, "no session cookie");
  const api = await page.request.get(at("/api/overview"));
  assert.equal(api.status(), 401, "nothing is served without a session");
  await page.context().close();
});

test("the overview shows the relay, the outbox, each group's lag and the throughput chart", async () => {
  const page = await newPage();
  await login(page, env("OPERATOR_USER"), env("OPERATOR_PASSWORD"));
  assert.equal(page.url(), at("/"), "back to the overview, under the prefix");
  await assertInside(page);
  await page.waitForSelector('#overview[data-loaded="yes"]', { timeout: DEADLINE_MS });
  await page.waitForSelector("#relay td:text('active')", { timeout: DEADLINE_MS });
  await page.waitForSelector("#panel-throughput svg polyline", { state: "attached", timeout: DEADLINE_MS });
  // Each group shows once it has owned its partitions (the overview refreshes every second).
  for (const group of ["inventory", "notification"]) {
    await page.waitForSelector(`#groups tr[data-group="${group}"]`, { timeout: DEADLINE_MS });
  }
  await page.waitForFunction(() => document.querySelectorAll("#partitions tbody tr").length >= 6, null, { timeout: DEADLINE_MS });
  const groups = await page.$$eval("#groups tbody tr", (rows) => rows.map((r) => r.dataset.group));
  assert.ok(groups.includes("inventory") && groups.includes("notification"), `groups: ${groups}`);
  const partitions = await page.$$eval("#partitions tbody tr", (rows) => rows.length);
  assert.ok(partitions >= 6, `a row per group and partition: ${partitions}`);
  // Sortable: a click on "lag (messages)" orders the rows by it.
  await page.click("#partitions th:text('partition')");
  await page.click("#partitions th:text('partition')");
  const order = await page.$$eval("#partitions tbody tr td:nth-child(3)", (tds) => tds.map((t) => Number(t.textContent)));
  assert.deepEqual(order, [...order].sort((a, b) => b - a), "sorted descending");
  const headers = (await page.request.get(at("/"))).headers();
  assert.match(headers["content-security-policy"], /script-src 'self'/);
  assert.equal(headers["x-frame-options"], "DENY");
  await shot(page, "overview-start.png");
  assert.deepEqual(page.problems, [], "no script error or CSP violation");
  await page.context().close();
});

test("a dead-lettered order is found, replayed, and its parked events applied in order", async () => {
  const order = env("DEAD_ORDER");
  const page = await newPage();
  await login(page, env("OPERATOR_USER"), env("OPERATOR_PASSWORD"));
  // Found from the dead letters' list, then its timeline.
  await page.goto(at("/dead-letters"));
  const row = page.locator(`#letters tr[data-order="${order}"]`);
  await row.waitFor();
  assert.match(await row.textContent(), /already has a reservation/);
  await row.locator("a").first().click();
  await page.waitForSelector("#timeline");
  const before = await timelineRows(page, "inventory");
  assert.ok(before.some((s) => s.what === "dead_lettered" && s.seq === "1"), JSON.stringify(before));
  assert.equal(before.filter((s) => s.what === "parked").length, 2, JSON.stringify(before));

  // Replay it: the letters of this order, ticked, with a note and the confirmation.
  await page.goto(at(`/dead-letters?group=inventory&order=${order}`));
  await page.check(`#letters tr[data-order="${order}"] input[type="checkbox"]`);
  await page.selectOption('select[name="how"]', "replay");
  await shot(page, "dead-letters.png");
  await act(page, "stale reservation removed");
  await page.waitForSelector("#outcomes");
  const outcomes = await page.$$eval("#outcomes tbody tr", (rows) => rows.map((r) => {
    const heads = [...r.closest("table").tHead.rows[0].cells].map((c) => c.textContent);
    return Object.fromEntries([...r.cells].map((c, i) => [heads[i], c.textContent]));
  }));
  assert.equal(outcomes.length, 1, JSON.stringify(outcomes));
  assert.equal(outcomes[0].outcome, "replayed");
  assert.equal(outcomes[0].parked_events_unparked, "2", "two parked events unparked");

  await page.goto(at(`/timeline?id=${order}`));
  const steps = await timelineRows(page, "inventory");
  // Applied in sequence: the replayed event, then the two it unparked.
  const of = (what) => steps.filter((s) => s.what === what).map((s) => s.seq);
  assert.deepEqual(of("applied"), ["1", "2", "3"], JSON.stringify(steps));
  assert.deepEqual(of("unparked"), ["2", "3"], JSON.stringify(steps));
  const action = steps.find((s) => s.what === "dead_letter.replay");
  assert.ok(action, JSON.stringify(steps));
  assert.match(action.detail, new RegExp(`by ${env("OPERATOR_USER")}: stale reservation removed`));
  await shot(page, "timeline.png");
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

test("a failed outbox event is requeued and published, then its order's held events", async () => {
  const order = env("FAILED_ORDER");
  const page = await newPage();
  await login(page, env("OPERATOR_USER"), env("OPERATOR_PASSWORD"));
  await page.goto(at("/outbox"));
  await page.check(`#failed tr[data-event="${env("FAILED_EVENT")}"] input[type="checkbox"]`);
  await act(page, "topic limit raised");
  await page.waitForSelector("#outcomes");
  assert.match(await page.textContent("#outcomes"), new RegExp(env("FAILED_EVENT")));
  // The group may apply the requeued event before the relay has recorded its delivery: wait
  // for both.
  await until(page, `/timeline?id=${order}`, "the requeued order applied and published", async (p) => {
    const steps = await timelineRows(p, "notification");
    const outbox = (await timelineRows(p, "outbox")).map((s) => s.what);
    return steps.filter((s) => s.what === "applied").length >= 2 && outbox.includes("published");
  });
  const outbox = await timelineRows(page, "outbox");
  const kinds = outbox.map((s) => s.what);
  assert.ok(kinds.includes("failed") && kinds.includes("requeued") && kinds.includes("published"), kinds.join(","));
  await page.context().close();
});

test("a paused group's lag grows, and it drains once resumed", async (t) => {
  const group = env("PAUSE_GROUP", "notification");
  const page = await newPage();
  await login(page, env("OPERATOR_USER"), env("OPERATOR_PASSWORD"));
  await page.goto(at("/groups"));
  const form = page.locator(`section.group[data-group="${group}"] form.pause`);
  if ((await form.count()) === 0) {
    t.skip("this console offers no group pause");
    await page.context().close();
    return;
  }
  await form.locator("input.note").fill("deploying the mail relay");
  await form.locator('input[name="confirm"]').check();
  await form.locator("button.act").click();
  await page.waitForSelector("#outcomes");
  // New orders while paused: the group's lag grows. Its members see the pause within about a
  // second, so orders go on until the lag shows.
  await page.goto(at("/"));
  const deadline = Date.now() + DEADLINE_MS;
  let seen;
  for (;;) {
    const r = await fetch(`${ORDER_SERVICE}/orders`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ customer_id: "c-console", lines: [{ product_id: "sku-00001", quantity: 1 }] }),
    });
    assert.equal(r.status, 201);
    seen = await lagOf(page, group);
    if (seen.state === "paused" && seen.lag >= 5) break;
    if (Date.now() > deadline) assert.fail(`lag of paused ${group}: ${JSON.stringify(seen)}`);
    await page.waitForTimeout(1000);
  }
  // It stays: a paused group applies nothing.
  await page.waitForTimeout(3000);
  const still = await lagOf(page, group);
  assert.ok(still.lag >= seen.lag, `paused ${group} applied events: ${JSON.stringify([seen, still])}`);
  await page.waitForSelector(`#groups tr[data-group="${group}"] td:text('paused')`, { timeout: DEADLINE_MS });
  await shot(page, "overview-paused.png");
  await page.goto(at("/groups"));
  const resume = page.locator(`section.group[data-group="${group}"] form.resume`);
  await resume.locator("input.note").fill("mail relay back");
  await resume.locator('input[name="confirm"]').check();
  await resume.locator("button.act").click();
  await page.waitForSelector("#outcomes");
  await page.goto(at("/"));
  for (;;) {
    seen = await lagOf(page, group);
    if (seen.state === "running" && seen.lag === 0) break;
    if (Date.now() > deadline + DEADLINE_MS) assert.fail(`resumed ${group} did not drain: ${JSON.stringify(seen)}`);
    await page.waitForTimeout(1000);
  }
  // The overview after the burst: the chart shows the paused group catching up.
  await page.waitForSelector(`#groups tr[data-group="${group}"] td:text('running')`, { timeout: DEADLINE_MS });
  await shot(page, "overview.png");
  await page.context().close();
});

test("a read-only user sees everything and can act on nothing", async () => {
  const page = await newPage();
  await login(page, env("VIEWER_USER"), env("VIEWER_PASSWORD"));
  await page.waitForSelector('#overview[data-loaded="yes"]', { timeout: DEADLINE_MS });
  for (const [url, selector] of [["/dead-letters?status=", "#letters"], ["/outbox", "#failed"], [`/timeline?id=${env("DEAD_ORDER")}`, "#timeline"], ["/groups", "h1"]]) {
    await page.goto(at(url));
    await page.waitForSelector(selector);
    await assertInside(page);
    const buttons = await page.$$eval("button.act", (bs) => bs.map((b) => b.disabled));
    assert.ok(buttons.every((d) => d), `${url}: every action button is disabled`);
  }
  // The server refuses a viewer's action even with the session's own CSRF token.
  await page.goto(at("/outbox"));
  const csrf = await page.getAttribute('input[name="csrf"]', "value");
  const status = await page.evaluate(async ([url, csrf]) => {
    const body = new URLSearchParams({ csrf, note: "try", confirm: "yes", order: "any" });
    const r = await fetch(url, { method: "POST", body });
    return [r.status, await r.text()];
  }, [at("/actions/requeue"), csrf]);
  assert.equal(status[0], 403);
  assert.match(status[1], /viewer/);
  await page.context().close();
});

test("an overview whose session ended goes to the login form, and back after it", async () => {
  const page = await newPage();
  await login(page, env("VIEWER_USER"), env("VIEWER_PASSWORD"));
  await page.waitForSelector('#overview[data-loaded="yes"]', { timeout: DEADLINE_MS });
  // The script's next reading is refused (401): it sends the page to the login form.
  await page.context().clearCookies();
  await page.waitForURL((url) => url.href.startsWith(at("/login?next=")), { timeout: DEADLINE_MS });
  await assertInside(page);
  await page.fill('input[name="user"]', env("VIEWER_USER"));
  await page.fill('input[name="password"]', env("VIEWER_PASSWORD"));
  await page.click('button[type="submit"]');
  await page.waitForSelector("#overview");
  assert.equal(page.url(), at("/"));
  await page.context().close();
});

test("a POST without the CSRF token is refused", async () => {
  const page = await newPage();
  await login(page, env("OPERATOR_USER"), env("OPERATOR_PASSWORD"));
  await page.goto(at("/outbox"));
  const refused = await page.evaluate(async (url) => {
    const body = new URLSearchParams({ note: "forged", confirm: "yes", order: "any" });
    const r = await fetch(url, { method: "POST", body });
    return [r.status, await r.text()];
  }, at("/actions/requeue"));
  assert.equal(refused[0], 403);
  assert.match(refused[1], /CSRF/);
  const wrong = await page.evaluate(async (url) => {
    const body = new URLSearchParams({ csrf: "0".repeat(64), note: "forged", confirm: "yes", order: "any" });
    return (await fetch(url, { method: "POST", body })).status;
  }, at("/api/actions/requeue"));
  assert.equal(wrong, 403);
  await page.context().close();
});
