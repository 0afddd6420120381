"""The timeline page on the live cluster, opened in a real browser (headless Chromium).

hai-alice's LOW job holds all four nodes; hai-bob's HIGH job preempts it (suspend notice,
go_suspend(), requeue); when it is done the LOW job runs again. `hai timeline` (as alice)
draws her job only; `hai-admin timeline` (as root) draws both, with the marks from alice's
job directory. Chromium runs the page's script (--dump-dom: the jobs, the marks and their
hover text are in the DOM; a mouse moved onto the suspend mark shows its text) and draws it
(--screenshot: the PNG shows both levels' colours).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import time
import zlib
from pathlib import Path

from test_jobs import submit, wait_status, write_script

from slurm_hai.jobs.timeline import level_colours
from slurm_hai.policy.levels import DEFAULT_LADDER

SUSPENDS_ONCE = """
    import time
    import slurm_hai as hai
    run = hai.restart_count()
    print(f"run {run} polling", flush=True)
    while run == 0:
        if hai.receive_suspend_command():
            hai.go_suspend()
        time.sleep(0.05)
    time.sleep(2)
"""


HOVER_SUSPEND_MARK = """<script>
const mark = document.querySelector('#marks path[data-kind="suspend"]'), box = mark.getBoundingClientRect();
mark.dispatchEvent(new MouseEvent("mousemove", {bubbles: true, clientX: box.x + 2, clientY: box.y + 2}));
</script>"""


def chromium(page: Path, home: Path, *flags: str) -> subprocess.CompletedProcess:
    """Debian's headless Chromium on `page`, as root, with its profile and caches in `home`."""
    browser = shutil.which("chromium")
    assert browser, "no chromium on PATH: `make test-tools` installs it (apt-get install chromium fonts-liberation)"
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"),
           "XDG_CACHE_HOME": str(home / "cache")}
    return subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu",
                           f"--user-data-dir={home}/profile", "--window-size=1200,600", *flags, page.as_uri()],
                          env=env, text=True, capture_output=True, timeout=90)


def png_pixels(path: Path) -> list[tuple[int, int, int]]:
    """The RGB pixels of an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and not interlace, header
    bpp = 3 if colour == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a, b = line[i - bpp] if i >= bpp else 0, prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(line)
        prev = line
    return [tuple(row[x * bpp:x * bpp + 3]) for row in rows for x in range(width)]


def rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))


def test_timeline_page_shows_a_preemption_in_a_real_browser(live, tmp_path):
    """No policy daemon: Slurm preempts by its QOS alone, and the page tells the cause in
    words without naming the job it was for (only the daemon's word names it; that is
    test_frontdoor.py's)."""
    time.sleep(2)  # the jobs the fixture cancelled ended a second or more before this window opens
    t0 = time.time()
    low_dir = live.shared_dir("tl-low", owner="hai-alice")
    high_dir = live.shared_dir("tl-high", owner="hai-bob")
    low = submit(live, write_script(low_dir, SUSPENDS_ONCE, owner="hai-alice"), "-n", "4", "-p", "LOW",
                 "--name", "tl-low", user="hai-alice")
    st = wait_status(live, low, lambda s: s["state"] == "running", 60, "running", user="hai-alice")
    log, deadline = Path(st["job_dir"]) / "logs" / "rank-0.log", time.monotonic() + 60
    while "run 0 polling" not in (log.read_text() if log.exists() else ""):  # its script runs: preempt it now
        assert time.monotonic() < deadline, f"job {low}'s script did not start polling"
        time.sleep(0.2)
    high = submit(live, write_script(high_dir, "import time; time.sleep(3)\n", owner="hai-bob"), "-n", "1",
                  "-p", "HIGH", "--name", "tl-high", user="hai-bob")
    st = wait_status(live, low, lambda s: s["state"] == "finished-succeeded", 90, "the rerun to finish",
                     user="hai-alice")
    assert st["restarts"] == 1 and st["suspends"] == 1
    assert ": preempted by a job of a higher level" in st["last_suspend"], st  # hai status, in words

    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0))  # this test's window: no earlier job

    # hai timeline: alice's job only, on the nodes it held
    work = live.shared_dir("tl-page", owner="hai-alice")
    mine = live.run(["hai", "timeline", "--since", since, "--json"], user="hai-alice").stdout
    data = json.loads(mine)
    # (a job of an earlier test may still have been ending when the window opened: hers only)
    assert {i["user"] for i in data["intervals"]} == {"hai-alice"} and high not in {i["job_id"] for i in data["intervals"]}
    assert {i["node"] for i in data["intervals"] if i["job_id"] == low} == {"n1", "n2", "n3", "n4"}
    assert [(m["kind"], m["job_id"]) for m in data["marks"] if m["job_id"] == low] == [("suspend", low), ("restart", low)]
    p = live.run(["hai", "timeline", "--since", since, "--out", "alice.html"], user="hai-alice", cwd=work)
    assert p.stdout.startswith("wrote alice.html: ") and (work / "alice.html").is_file()

    # hai-admin timeline as root: both jobs, alice's marks read from her job directory
    page = tmp_path / "timeline.html"
    live.run(["hai-admin", "timeline", "--since", since, "--out", str(page)])
    admin_data = json.loads(live.run(["hai-admin", "timeline", "--since", since, "--json"]).stdout)
    runs = {(i["job_id"], i["run"]) for i in admin_data["intervals"]}
    assert {(low, 0), (low, 1), (high, 0)} <= runs

    # a real browser runs the page's script: the jobs, the marks and their hover text are drawn
    dom = chromium(page, tmp_path / "browser", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    for job in (low, high):
        assert re.search(rf'<rect [^>]*class="interval[^"]*"[^>]*data-job="{job}"', dom.stdout), f"job {job} not drawn"
        assert re.search(rf'<tr data-job="{job}">', dom.stdout), f"job {job} not in the table"
    suspend = re.search(rf'<path [^>]*data-job="{low}" data-kind="suspend"[^>]*><title>([^<]*)</title>', dom.stdout)
    assert suspend and "preempted by a job of a higher level" in suspend.group(1)
    assert re.search(rf'data-job="{low}" data-kind="restart"', dom.stdout)

    # hovering the suspend mark shows its text (a copy of the page moves the mouse onto it)
    hovered = tmp_path / "hovered.html"
    hovered.write_text(page.read_text().replace("</body>", HOVER_SUSPEND_MARK + "</body>"))
    tip = re.search(r'<div id="tip" style="display: block;[^"]*">([^<]*)<', chromium(hovered, tmp_path / "browser",
                                                                                   "--dump-dom").stdout)
    assert tip and tip.group(1).startswith(f"job {low} (LOW) run 0 suspended at ") and "preempted" in tip.group(1)

    # and draws it: both levels' colours are on the screenshot
    shot = tmp_path / "timeline.png"
    taken = chromium(page, tmp_path / "browser", f"--screenshot={shot}")
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    pixels = png_pixels(shot)
    colours = dict(level_colours(DEFAULT_LADDER))
    counts = {level: pixels.count(rgb(colours[level])) for level in ("LOW", "HIGH")}
    assert all(n > 500 for n in counts.values()), counts
    assert len(set(pixels)) > 20  # text, axis, legend: not a blank page
