"""The recipe's ``/status`` page on its ops port, in headless Chromium, over a real stack
(every service its own process, fake engine: quick to start on two cores).

A few requests give it data; the page must then show both instances grouped by role and
bucket, draw the cache hit rate and the error/retry rates on its canvases, show the kvstore's
capacity panel, and lay its panels out in order. With the kvstore killed, ``/status.json``
still answers and says "unreachable", and so does the page.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from deepserve.up import Stack
from services.recipe.handlers import tenant_label

from ..sdk_strict import strict_http
from .conftest import READY_TIMEOUT, dump_logs

pytestmark = pytest.mark.timeout(180)

MODEL = "deepseek-fake"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
WIDTH, HEIGHT = 1280, 1300
PANELS = ("panel-instances", "panel-hit", "panel-kvstore", "panel-errors")
HIT_BLUE = (0x25, 0x63, 0xEB)  # the hit-rate line (status_page.py)
ERROR_COLOURS = ((0xDC, 0x26, 0x26), (0xD9, 0x77, 0x06), (0x7C, 0x3A, 0xED))
PROMPT = "The status page shows the cache at work. " * 40  # > 2 blocks of 128 tokens
KEY = "sk-status-page"


@pytest.fixture(scope="module")
def status_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        tmp_path_factory.mktemp("status-stack"),
        prefill=1,
        decode=1,
        model="fake",
        model_name=MODEL,
        ready_timeout=READY_TIMEOUT,
        drain_seconds=2.0,
        env=dict(os.environ),
        extra_args={"recipe": ["--status-interval", "1", "--api-keys", f"{KEY}=acme"]},
    )
    try:
        s.start()
        yield s
    finally:
        s.stop()


def ops_base(stack: Stack) -> str:
    recipe = next(c for c in stack.children if c.service == "recipe")
    return f"http://127.0.0.1:{recipe.ops_port}"


NO_BROWSER = "chromium and chromedriver are not installed (scripts/setup.sh installs them)"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium through Debian's chromedriver; None where they are not installed
    (the page tests skip, the JSON checks still run)."""
    if not (shutil.which("chromium") and os.path.exists(CHROMEDRIVER)):
        yield None
        return
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={WIDTH},{HEIGHT}")
    options.add_argument("--force-device-scale-factor=1")
    # A driver path given: selenium-manager finds and downloads nothing.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, script: str, timeout: float = 20.0) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(
        lambda d: d.execute_script(script)
    )


def chat(stack: Stack, content: str) -> dict[str, Any]:
    r = strict_http(httpx.Client()).post(
        f"{stack.api_url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def status_json(stack: Stack, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """``/status.json`` once ``done`` says so (or after 15 s); always a 200."""
    deadline = time.monotonic() + 15
    while True:
        r = httpx.get(f"{ops_base(stack)}/status.json", timeout=5)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        if done(data) or time.monotonic() > deadline:
            return data
        time.sleep(0.3)


def pixels(image: np.ndarray, box: dict[str, float]) -> np.ndarray:
    """The screenshot's pixels (RGB) inside ``box`` (CSS px; the page renders at scale 1)."""
    return image[int(box["y"]) : int(box["bottom"]), int(box["x"]) : int(box["right"]), :3]


def count_colour(image: np.ndarray, box: dict[str, float], colour: tuple[int, int, int]) -> int:
    """Pixels inside ``box`` within 40 of ``colour`` on every channel (antialiasing)."""
    diff = np.abs(pixels(image, box).astype(int) - np.array(colour))
    return int(np.all(diff <= 40, axis=-1).sum())


def test_status_page_shows_the_stack(status_stack: Stack, browser: Any, tmp_path: Path) -> None:
    # The repeats hit the prefix the first one cached, once its blocks reached the kvstore.
    sent, hits, prompt, cached, deadline = 0, 0, 0, 0, time.monotonic() + 20
    while hits < 2 and time.monotonic() < deadline:
        usage = chat(status_stack, PROMPT)["usage"]
        sent += 1
        prompt += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
        hits += usage["prompt_tokens_details"]["cached_tokens"] > 0
        time.sleep(0.3)
    assert hits == 2, dump_logs(status_stack)
    data = status_json(status_stack, lambda d: (d["totals"]["requests"] or 0) >= sent)
    assert data["totals"]["hit_rate"] == pytest.approx(cached / prompt), data["totals"]
    raw = httpx.get(f"{ops_base(status_stack)}/status.json", timeout=5).text
    for secret in (KEY, "acme", tenant_label("acme"), PROMPT[:20]):
        assert secret not in raw, f"/status.json shows {secret!r}"
    if browser is None:
        pytest.skip(f"/status.json checked; the page not: {NO_BROWSER}")
    browser.get(f"{ops_base(status_stack)}/status")
    try:
        wait_for(
            browser,
            "return Number(document.body.dataset.rendered) >= 1"
            " && document.querySelectorAll('tr.instance').length >= 2"
            " && Number(document.getElementById('chart-hit').dataset.points) >= 1"
            " && Number(document.getElementById('chart-errors').dataset.points) >= 1",
        )
    except Exception:
        print(browser.execute_script("return document.body.innerText"))
        print(dump_logs(status_stack))
        raise
    assert browser.execute_script("return document.body.dataset.error || ''") == ""
    rows = browser.execute_script(
        "return [...document.querySelectorAll('tr.group')]"
        ".map(r => [r.dataset.role, r.dataset.bucket, r.cells[0].textContent])"
    )
    assert [r[0] for r in rows] == ["prefill", "decode"], rows
    assert rows[0][1] not in ("", "unknown"), "the balancer's bucket of the prefill instance"
    assert browser.find_element("id", "kv-state").text == "ok"
    assert browser.find_element("id", "kv-targets").get_attribute("childElementCount") == "12"
    assert browser.find_element("id", "hit-total").text.endswith("% since start")

    boxes: dict[str, dict[str, float]] = browser.execute_script(
        "const out = {};"
        "for (const id of arguments[0]) {"
        "  const r = document.getElementById(id).getBoundingClientRect();"
        "  out[id] = {x: r.x, y: r.y, right: r.right, bottom: r.bottom,"
        "             width: r.width, height: r.height}; }"
        "return out;",
        [*PANELS, "chart-hit", "chart-errors", "instances"],
    )
    for name, b in boxes.items():
        assert b["width"] > 50 and b["height"] > 50, (name, b)
        assert b["bottom"] <= HEIGHT, f"{name} is below the window: {b}"
    inst, hit, kv, err = (boxes[p] for p in PANELS)
    assert inst["bottom"] <= hit["y"] and inst["bottom"] <= kv["y"], "instances first"
    assert hit["right"] <= kv["x"] and abs(hit["y"] - kv["y"]) < 2, "hit rate | kvstore"
    assert max(hit["bottom"], kv["bottom"]) <= err["y"], "errors and retries last"

    from PIL import Image

    png = browser.get_screenshot_as_png()
    (tmp_path / "status.png").write_bytes(png)
    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert image.shape[1] >= WIDTH - 20, image.shape
    assert count_colour(image, boxes["chart-hit"], HIT_BLUE) > 20, "no hit-rate line drawn"
    assert sum(count_colour(image, boxes["chart-errors"], c) for c in ERROR_COLOURS) > 20
    # Each panel has content drawn in it, not only its background.
    for name in PANELS:
        colours = np.unique(pixels(image, boxes[name]).reshape(-1, 3), axis=0)
        assert len(colours) > 8, f"{name} looks empty"


def test_a_dead_kvstore_shows_as_unreachable(status_stack: Stack, browser: Any) -> None:
    kvstore = next(c for c in status_stack.children if c.service == "kvstore")
    os.killpg(kvstore.pid, signal.SIGKILL)
    data = status_json(status_stack, lambda d: d["kvstore"]["state"] == "unreachable")
    assert data["kvstore"]["state"] == "unreachable", data["kvstore"]
    (source,) = data["sources"]["kvstore"]
    assert not source["ok"] and "unreachable" in source["error"]
    assert len(data["instances"]) == 2, "the rest of the page still reads"
    recipe = next(c for c in status_stack.children if c.service == "recipe")
    assert recipe.running(), dump_logs(status_stack)
    if browser is None:
        pytest.skip(f"/status.json checked; the page not: {NO_BROWSER}")
    browser.get(f"{ops_base(status_stack)}/status")
    wait_for(browser, "return document.getElementById('kv-state').textContent === 'unreachable'")
    assert "unreachable" in browser.find_element("id", "kv-errors").text


def test_an_instance_loading_its_model_shows_with_its_progress(
    status_stack: Stack, browser: Any
) -> None:
    """A LoadStatus as an engine instance publishes it while its weights load (with the prefill
    role's NATS rights) reaches the page; the instance is no routing row."""
    import asyncio

    import nats

    from libs.common import subjects
    from libs.proto.deepserve.v1 import control_pb2

    iid = "prefill-loading"
    status = control_pb2.LoadStatus(
        instance_id=iid,
        role="prefill",
        model=MODEL,
        source="DeepSeek-V3",
        shards_done=40,
        shards_total=163,
        bytes_done=170 * 10**9,
        bytes_total=689 * 10**9,
        bytes_read=170 * 10**9,
        seconds=80.0,
    )

    async def publish() -> None:
        nc = await nats.connect(status_stack.nats_url_of("prefill"))
        for _ in range(3):  # one per collector tick, as the instance sends them
            await nc.publish(subjects.load_status("prefill", iid), status.SerializeToString())
            await nc.flush()
            await asyncio.sleep(0.5)
        await nc.close()

    asyncio.run(publish())
    data = status_json(status_stack, lambda d: any(r["id"] == iid for r in d["loading"]))
    (row,) = [r for r in data["loading"] if r["id"] == iid]
    assert (row["shards_done"], row["shards_total"]) == (40, 163), row
    assert 0.24 < row["fraction"] < 0.25 and row["eta_s"] > 200 and row["read_bytes_per_s"] > 0
    assert iid not in {r["id"] for r in data["instances"]}
    if browser is None:
        pytest.skip(f"/status.json checked; the page not: {NO_BROWSER}")
    browser.get(f"{ops_base(status_stack)}/status")
    wait_for(browser, "return document.querySelectorAll('tr.loading').length >= 1")
    text = browser.find_element("css selector", "tr.loading").text
    assert iid in text and "40 / 163" in text and "GB/s" in text, text
