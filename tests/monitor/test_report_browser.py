"""The report opened in a real headless Chromium (Debian's chromium + chromium-driver, driven by
selenium): it loads with no console error and no network, every plot draws its curves, the event
markers are there, and a completion holding a <script> tag stays text."""

from __future__ import annotations

import shutil

from monitor.conftest import online_metrics
from rlft.monitor.report import write_report

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Flags that work on a closed network: nothing of the browser's own phones home.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000"]


def test_report_renders_in_headless_chromium(make_online_run, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    assert shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER), \
        "install the browser: apt-get install -y chromium chromium-driver (see the Makefile)"
    a = make_online_run("a", events=[{"step": 12, "detector": "length_drift", "action": "warn", "message": "long",
                                      "values": {"completion/length_mean": 52.0}}])
    b = make_online_run("b", training__learning_rate=3e-5, metrics=online_metrics(reward_slope=0.03),
                        events=[{"step": 25, "detector": "kl", "action": "stop", "message": "kl 0.6 > 0.5",
                                 "values": {"kl": 0.6}}])
    page = write_report([a, b], tmp_path / "report.html")
    n_plots = page.read_text().count("<div class='plot' ")

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(60)
        driver.get(page.as_uri())
        WebDriverWait(driver, 60).until(
            lambda d: d.execute_script("return document.querySelectorAll('.plot .main-svg').length") >= n_plots)
        drawn = driver.execute_script("""
            return Array.from(document.querySelectorAll('.plot')).map(p =>
                Array.from(p.querySelectorAll('path.js-line')).filter(l => (l.getAttribute('d') || '').length > 10)
                    .length)""")
        assert len(drawn) == n_plots > 20
        assert all(n >= 2 for n in drawn), drawn  # each plot drew a line for each of the two runs
        notes = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".annotation-text")]
        assert "kl (b)" in notes and "length_drift (a)" in notes
        assert driver.execute_script("return typeof window.__pwned") == "undefined"  # escaped, not run
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
        png = driver.get_screenshot_as_png()
        assert len(png) > 50_000  # a page of plots, not a blank canvas (blank is a few KB)
    finally:
        driver.quit()
