"""coli serve's page in a real browser: headless Chromium driven by selenium.

    python3 tests/serve/page_browser.py http://127.0.0.1:8080 [--key KEY] [--screenshot PATH]

Loads the page, (with --key: finds the key asked for and types it), sends a message and
waits for the streamed answer, checks that the routing grid received events naming
experts of the model's shape and marks the last step's experts; asks for an answer of
LONG tokens (the server runs with LONG_CONTEXT=1) and stops it, then checks on /metrics
that the server stopped generating it; regenerates the last answer. --screenshot saves the window (1400x900) after the first answer.
Prints OK at the end; any failure raises. Needs the `selenium` package, `chromium` and
`chromedriver` (Debian: apt-get install chromium chromium-driver).
"""

import argparse
import shutil
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

LIMIT = 60
# An answer no server finishes before Stop: the test fails if this one is generated whole.
LONG = 100000


def browser():
    driver_path = shutil.which("chromedriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not driver_path or not chromium:
        sys.exit("chromium and chromedriver are needed on PATH (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,900", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    # The window's size less the page's is what the browser takes: the page gets 1400x900.
    inner = driver.execute_script("return [window.innerWidth, window.innerHeight]")
    driver.set_window_size(1400 + 1400 - inner[0], 900 + 900 - inner[1])
    return driver


def metric(base, name, key):
    request = urllib.request.Request(base + "/metrics")
    if key:
        request.add_header("Authorization", "Bearer " + key)
    with urllib.request.urlopen(request, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def answers(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")


def ask(driver, text, max_tokens):
    tokens = driver.find_element(By.ID, "max-tokens")
    if not tokens.is_displayed():
        driver.find_element(By.CSS_SELECTOR, "#settings summary").click()
    tokens.clear()
    tokens.send_keys(str(max_tokens))
    before = len(answers(driver))
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()
    wait = WebDriverWait(driver, LIMIT)
    wait.until(lambda d: len(answers(d)) == before + 1)
    return answers(driver)[-1]


def text_of(bubble):
    return bubble.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("--key")
    parser.add_argument("--screenshot")
    args = parser.parse_args()
    base = args.base.rstrip("/")
    driver = browser()
    wait = WebDriverWait(driver, LIMIT)
    try:
        driver.get(base + "/")
        assert driver.title == "coli", driver.title
        grid = driver.find_element(By.ID, "grid")
        if args.key:
            # The routing stream is refused without the key: the page asks for it.
            form = driver.find_element(By.ID, "key-form")
            wait.until(lambda d: form.is_displayed())
            assert "API key" in driver.find_element(By.ID, "status").text
            driver.find_element(By.ID, "key").send_keys(args.key)
            form.find_element(By.CSS_SELECTOR, "button").click()
        wait.until(lambda d: grid.get_attribute("data-experts"))
        experts = int(grid.get_attribute("data-experts"))
        layers = [int(l) for l in grid.get_attribute("data-moe-layers").split()]
        assert experts > 0 and layers, (experts, layers)

        # A message, its answer streamed in.
        first = ask(driver, "Tell me about the sea.", 24)
        wait.until(lambda d: text_of(first).strip())
        wait.until(lambda d: first.get_attribute("data-done"))
        assert first.get_attribute("data-done") == "length", first.get_attribute("data-done")
        assert "24 tokens" in first.find_element(By.CSS_SELECTOR, ".meta").text

        # The grid followed the generation: events, and the last step's experts marked.
        wait.until(lambda d: int(grid.get_attribute("data-events")) > 0)
        wait.until(lambda d: grid.get_attribute("data-last-routed").strip())
        for cell in grid.get_attribute("data-last-routed").split():
            layer, expert = (int(part) for part in cell.split(":"))
            assert layer in layers and 0 <= expert < experts, cell
        tokens = driver.find_element(By.ID, "stat-tokens")
        wait.until(lambda d: int(tokens.text or 0) >= 24)
        assert driver.find_element(By.ID, "stat-hit").text.endswith("%")
        if args.screenshot:
            driver.find_element(By.ID, "input").send_keys("And the sky?")
            time.sleep(0.8)  # the glow of the last step fades
            driver.save_screenshot(args.screenshot)
            driver.find_element(By.ID, "input").clear()

        # Stop: the page aborts the stream and the server stops generating.
        abandoned = metric(base, "coli_generations_abandoned_total", args.key)
        done_tokens = metric(base, "coli_completion_tokens_total", args.key)
        long = ask(driver, "Now tell me everything you know.", LONG)
        WebDriverWait(driver, LIMIT, poll_frequency=0.05).until(lambda d: text_of(long).strip())
        driver.find_element(By.ID, "stop").click()
        wait.until(lambda d: long.get_attribute("data-done") == "stopped")
        deadline = time.time() + LIMIT
        while metric(base, "coli_generations_abandoned_total", args.key) < abandoned + 1:
            assert time.time() < deadline, "the server went on generating after Stop"
            time.sleep(0.2)
        generated = metric(base, "coli_completion_tokens_total", args.key) - done_tokens
        assert generated < LONG, generated

        # Regenerate: the stopped answer goes and the last message is asked again.
        regenerate = driver.find_element(By.ID, "regenerate")
        wait.until(lambda d: regenerate.is_enabled())
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("6")
        regenerate.click()
        wait.until(lambda d: len(answers(d)) == 2 and answers(d)[-1] != long)
        again = answers(driver)[-1]
        wait.until(lambda d: again.get_attribute("data-done"))
        assert again.get_attribute("data-done") == "length", again.get_attribute("data-done")
        assert text_of(again).strip()
        users = driver.find_elements(By.CSS_SELECTOR, "#messages .message.user")
        assert len(users) == 2, len(users)
        # With a key, the refusal of the first routing request is logged: that one only.
        logs = [entry for entry in driver.get_log("browser")
                if entry["level"] == "SEVERE" and not (args.key and "/routing" in entry["message"] and " 401 " in entry["message"])]
        assert not logs, logs
    finally:
        driver.quit()
    print("OK")


if __name__ == "__main__":
    main()
