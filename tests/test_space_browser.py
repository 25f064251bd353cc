"""The Space in a real browser: headless Debian Chromium driven by Playwright opens the page, gets a clear error for an
empty prompt, generates for a prompt and shows the speculative reply as coloured token spans grouped in rounds.

Needs `/usr/bin/chromium` (Debian's `chromium` package; `.ci/run` installs it). It fails, never skips, without it:
never `playwright install` (it downloads a browser)."""

import os
import socket
from pathlib import Path

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import pytest  # noqa: E402
from playwright.sync_api import expect, sync_playwright  # noqa: E402

import angelspec_hf  # noqa: E402
from angelspec_hf.spaces_demo.app import DemoModels, build_demo  # noqa: E402

pytestmark = pytest.mark.real_model
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]


@pytest.fixture(scope="module")
def url():
    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)"
    target, tokenizer = angelspec_hf.load_default_target()
    demo = build_demo(DemoModels(target, tokenizer, warmup=False), batch_view=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield demo.local_url
    finally:
        demo.close()


@pytest.fixture(scope="module")
def page(url):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1200})
        page.goto(url)
        yield page
        browser.close()


def test_empty_prompt_shows_an_error(page):
    page.click("#go")
    expect(page.get_by_text("Please enter a prompt: it is empty.").first).to_be_visible(timeout=30_000)


def test_generate_shows_coloured_tokens_in_rounds(page, tmp_path):
    expect(page.locator("#status")).to_contain_text("Ready", timeout=120_000)
    page.fill("#prompt textarea", "Write a Python function that squares a number.")
    number = page.locator("#max_tokens input[type=number]")
    number.fill("16")
    number.press("Enter")
    page.click("#go")
    expect(page.locator("#summary")).to_contain_text("Speed-up", timeout=180_000)
    spans = page.locator("#out span.tok")
    assert spans.count() == 16
    assert page.locator("#out span.blk").count() >= 2  # the prefill token and at least one round
    target_spans = page.locator("#out span.tok-target")
    assert target_spans.count() >= 2
    colour = target_spans.nth(1).evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour == "rgb(252, 211, 77)"  # the page's CSS reached the spans
    expect(page.locator("#summary")).to_contain_text("Identical to plain greedy output: yes")
    assert page.locator("#plain_out textarea").input_value().startswith("```python")
    page.screenshot(path=str(tmp_path / "space.png"), full_page=True)
    assert (tmp_path / "space.png").stat().st_size > 10_000
