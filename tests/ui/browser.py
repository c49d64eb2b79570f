"""The web page in a real browser (Debian's Chromium driven by Playwright), run by
tests/ui_browser.rs with one JSON argument:

  {"base": "http://127.0.0.1:PORT", "viewer": KEY, "service": KEY, "agent": NAME,
   "expected": {AGENT: {"sessions": TEXT, "signals": TEXT, "success": TEXT}},
   "usage_total": TEXT, "chromium": PATH, "axe": PATH, "screenshots": DIR or null}

Checks: a missing cookie and a wrong or service key are refused; a viewer signs in; every page
renders with no console error and no failed request; the figures are the gRPC answers; a viewer
finds no control that changes anything (the only form is sign-out); axe-core finds no serious or
critical violation. Prints one JSON line with the timings; exits 1 naming the first failure.
"""

import json
import sys
import time

from playwright.sync_api import sync_playwright

ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def fail(msg):
    print(json.dumps({"ok": False, "error": msg}))
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def main():
    cfg = json.loads(sys.argv[1])
    base = cfg["base"]
    axe_source = open(cfg["axe"], encoding="utf-8").read()
    out = {"ok": True, "pages": {}}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=cfg["chromium"], args=ARGS)
        ctx = browser.new_context(viewport={"width": 1200, "height": 900})
        page = ctx.new_page()
        errors = []
        failed = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("requestfailed", lambda r: failed.append(r.url))
        page.on("response", lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None)

        # No cookie: the sign-in page.
        page.goto(f"{base}/agents")
        check(page.url.endswith("/sign-in"), f"no cookie: landed on {page.url}")
        if cfg.get("screenshots"):
            page.screenshot(path=f"{cfg['screenshots']}/ui-sign-in.png", full_page=True)
        check(not errors and not failed, f"sign-in page: {errors} {failed}")

        # Wrong key, then a service key: refused with a clear message.
        for key, text in [("nmk_" + "0" * 48, "unknown or revoked"), (cfg["service"], "service key cannot sign in")]:
            page.fill("#key", key)
            with page.expect_navigation():
                page.click("button[type=submit]")
            check(text in page.content(), f"refusal page lacks {text!r}: {page.inner_text('main')[:300]}")
            check("/sign-in" in page.url, f"refused key went to {page.url}")
        errors.clear()
        failed.clear()

        # A viewer signs in.
        page.fill("#key", cfg["viewer"])
        with page.expect_navigation():
            page.click("button[type=submit]")
        check(page.url.endswith("/agents"), f"after sign-in: {page.url}")
        cookies = ctx.cookies()
        session = [c for c in cookies if c["name"] == "nm_ui_session"]
        check(session and session[0]["httpOnly"] and session[0]["sameSite"] == "Strict", f"cookie: {cookies}")

        pages = [
            ("agents", "/agents"),
            ("agent", "/agents/" + cfg["agent_path"]),
            ("experiments", "/experiments"),
            ("usage", "/usage"),
        ]
        for name, path in pages:
            errors.clear()
            failed.clear()
            t0 = time.monotonic()
            page.goto(base + path)
            page.wait_for_load_state("load")
            out["pages"][name] = round((time.monotonic() - t0) * 1000, 1)
            check(not errors, f"{path}: console errors {errors}")
            check(not failed, f"{path}: failed requests {failed}")
            # Read-only: the only form is sign-out; no other button.
            forms = page.eval_on_selector_all("form", "fs => fs.map(f => f.getAttribute('action'))")
            check(forms == ["/sign-out"], f"{path}: forms {forms}")
            buttons = page.eval_on_selector_all("button", "bs => bs.map(b => b.textContent.trim())")
            check(buttons == ["Sign out"], f"{path}: buttons {buttons}")
            # Accessibility.
            page.evaluate(axe_source)
            violations = page.evaluate(
                """async () => {
                    const r = await axe.run(document, {resultTypes: ['violations']});
                    return r.violations
                        .filter(v => v.impact === 'serious' || v.impact === 'critical')
                        .map(v => ({id: v.id, impact: v.impact, help: v.help,
                                    nodes: v.nodes.slice(0, 3).map(n => n.target.join(' '))}));
                }"""
            )
            check(not violations, f"{path}: axe violations {json.dumps(violations)}")
            if cfg.get("screenshots"):
                page.screenshot(path=f"{cfg['screenshots']}/ui-{name}.png", full_page=True)
            if name == "agents":
                for agent, want in cfg["expected"].items():
                    row = page.locator(f'tr[data-agent="{agent}"]')
                    for k, v in want.items():
                        got = row.locator(f'td[data-k="{k}"]').inner_text().strip()
                        check(got == v, f"/agents {agent} {k}: page {got!r}, gRPC {v!r}")
            if name == "usage":
                got = page.locator('p[data-k="usage-total"] strong').inner_text().strip()
                check(got == cfg["usage_total"], f"/usage total: page {got!r}, gRPC {cfg['usage_total']!r}")

        # Sign out: back to the sign-in page; the pages are refused again.
        with page.expect_navigation():
            page.click("text=Sign out")
        check("/sign-in" in page.url, f"after sign-out: {page.url}")
        page.goto(f"{base}/usage")
        check("/sign-in" in page.url, f"after sign-out /usage: {page.url}")
        browser.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
