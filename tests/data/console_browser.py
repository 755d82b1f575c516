"""Drives tidelog's web console in headless Chromium (selenium), as tests/console.rs asks.

Usage: console_browser.py BASE_URL SCREENSHOT_DIR GROUP EXPECTED_LAG

Opens the overview, creates a topic through the form, finds it listed, produces records
through the form (one whose value is markup), finds them in the message browser, reads a
group's lag, and deletes the topic through its confirmation page. Saves a screenshot of
every page in SCREENSHOT_DIR. Prints one line per step; exits non-zero on the first
failed check.
"""

import os
import sys

from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

BASE, SHOTS, GROUP, LAG = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
TOPIC = "console-topic"
EVIL = "<script>alert(1)</script>"


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}", flush=True)


def shot(driver, name):
    driver.save_screenshot(os.path.join(SHOTS, f"{name}.png"))


def go(driver, element):
    """Clicks `element` and waits until the next page has replaced this one and loaded
    (a new page starts with a new window object, without the mark set here)."""
    driver.execute_script("window.tidelogOldPage = true")
    element.click()
    WebDriverWait(driver, 20).until(
        lambda d: d.execute_script("return !window.tidelogOldPage && document.readyState === 'complete'")
    )


def no_alert(driver):
    try:
        driver.switch_to.alert
        return False
    except NoAlertPresentException:
        return True


def main():
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.binary_location = "/usr/bin/chromium"
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    wait = WebDriverWait(driver, 20)
    try:
        driver.get(BASE + "/")
        check(driver.title.startswith("Cluster"), "the overview opens")
        check(driver.find_element(By.ID, "controller-leader").text != "none", "a controller leads")
        check(driver.find_element(By.ID, "brokers-unfenced").text.startswith("1 /"), "the broker is unfenced")
        shot(driver, "overview")

        go(driver, driver.find_element(By.LINK_TEXT, "Topics"))
        form = driver.find_element(By.ID, "create-topic")
        form.find_element(By.NAME, "name").send_keys(TOPIC)
        form.find_element(By.NAME, "partitions").send_keys("3")
        form.find_element(By.NAME, "config").send_keys("retention.ms=86400000")
        go(driver, form.find_element(By.CSS_SELECTOR, "button[type=submit]"))
        wait.until(ec.presence_of_element_located((By.CLASS_NAME, "notice")))
        check(f"Created topic {TOPIC}" in driver.find_element(By.CLASS_NAME, "notice").text, "the create form reports success")
        check(len(driver.find_elements(By.LINK_TEXT, TOPIC)) == 1, "the new topic is listed")
        search = driver.find_element(By.ID, "filter")
        search.send_keys("no-such-topic")
        rows = driver.find_elements(By.CSS_SELECTOR, "#topics tbody tr")
        check(all(not r.is_displayed() for r in rows), "typing in the search hides topics that do not match")
        search.clear()
        shot(driver, "topics")

        driver.get(BASE + "/topics")
        go(driver, driver.find_element(By.LINK_TEXT, TOPIC))
        check(len(driver.find_elements(By.CSS_SELECTOR, "#partitions tbody tr")) == 3, "the topic page lists 3 partitions")
        check("retention.ms" in driver.find_element(By.ID, "config").text, "the topic page shows its config")
        shot(driver, "topic")

        go(driver, driver.find_element(By.LINK_TEXT, "Browse messages"))
        check(len(driver.find_elements(By.ID, "no-records")) == 1, "the empty topic has no records")
        for value in (EVIL, '{"amount": 42, "region": "eu"}'):
            form = driver.find_element(By.ID, "produce")
            form.find_element(By.NAME, "partition").send_keys("0")
            form.find_element(By.NAME, "key").send_keys("k1")
            form.find_element(By.NAME, "value").send_keys(value)
            form.find_element(By.NAME, "headers").send_keys("source=<b>console</b>")
            go(driver, form.find_element(By.CSS_SELECTOR, "#produce button[type=submit]"))
            wait.until(ec.presence_of_element_located((By.ID, "records")))
            check("Produced a record" in driver.find_element(By.CLASS_NAME, "notice").text, "the produce form reports success")
        driver.get(BASE + f"/topics/{TOPIC}/messages?partition=0&offset=0")
        values = [c.text for c in driver.find_elements(By.CSS_SELECTOR, "#records td.value")]
        check(values[0] == EVIL, f"the markup value is shown as text: {values[0]!r}")
        check(no_alert(driver), "no alert ran")
        scripts = driver.find_elements(By.TAG_NAME, "script")
        check(len(scripts) == 1, "the page holds only the console's own script")
        check(driver.find_elements(By.TAG_NAME, "b") == [], "a header value is not markup")
        check("source: <b>console</b>" in driver.find_element(By.CSS_SELECTOR, "#records td.headers").text, "headers are shown")
        shot(driver, "messages")
        go(driver, driver.find_element(By.LINK_TEXT, "json"))
        pretty = driver.find_elements(By.CSS_SELECTOR, "#records td.value pre.json")
        check(len(pretty) == 1 and '"amount": 42' in pretty[0].text, "the JSON view pretty-prints JSON values")
        go(driver, driver.find_element(By.LINK_TEXT, "hex"))
        check("3c 73 63 72" in driver.find_element(By.CSS_SELECTOR, "#records td.value").text, "the hex view dumps bytes")
        shot(driver, "messages-hex")
        driver.get(BASE + f"/topics/{TOPIC}/messages?partition=0&offset=1&limit=1")
        check([r.get_attribute("data-offset") for r in driver.find_elements(By.CSS_SELECTOR, "#records tbody tr")] == ["1"], "paging by offset")
        go(driver, driver.find_element(By.ID, "previous"))
        check([r.get_attribute("data-offset") for r in driver.find_elements(By.CSS_SELECTOR, "#records tbody tr")] == ["0"], "the previous page")
        go(driver, driver.find_element(By.ID, "next"))
        check([r.get_attribute("data-offset") for r in driver.find_elements(By.CSS_SELECTOR, "#records tbody tr")] == ["1"], "the next page")
        form = driver.find_element(By.ID, "seek")
        form.find_element(By.NAME, "time").send_keys("2099-01-01T00:00:00Z")
        go(driver, form.find_element(By.CSS_SELECTOR, "button[type=submit]"))
        check(len(driver.find_elements(By.ID, "no-records")) == 1, "a time after every record finds none (the time wins over the offset)")
        form = driver.find_element(By.ID, "seek")
        form.find_element(By.NAME, "time").clear()
        form.find_element(By.NAME, "time").send_keys("2000-01-01T00:00:00Z")
        go(driver, form.find_element(By.CSS_SELECTOR, "button[type=submit]"))
        check(driver.find_elements(By.CSS_SELECTOR, "#records tbody tr")[0].get_attribute("data-offset") == "0", "a time before every record starts at the first")

        go(driver, driver.find_element(By.LINK_TEXT, "Consumer groups"))
        go(driver, driver.find_element(By.LINK_TEXT, GROUP))
        lag = driver.find_element(By.ID, "total-lag").text
        check(lag == LAG, f"group {GROUP} shows lag {LAG} (shows {lag})")
        shot(driver, "group")
        form = driver.find_element(By.ID, "reset-offsets")
        form.find_element(By.CSS_SELECTOR, "select[name=to] option[value=offset]").click()
        form.find_element(By.NAME, "offset").send_keys("3")
        go(driver, form.find_element(By.CSS_SELECTOR, "button[type=submit]"))
        check("Committed new offsets for 1 partitions" in driver.find_element(By.CLASS_NAME, "notice").text, "the reset form reports success")
        check(driver.find_element(By.ID, "total-lag").text == str(int(LAG) + 1), "after a reset to offset 3 of 10 the lag is 7")
        form = driver.find_element(By.ID, "reset-offsets")
        form.find_element(By.CSS_SELECTOR, "select[name=to] option[value=latest]").click()
        go(driver, form.find_element(By.CSS_SELECTOR, "button[type=submit]"))
        check(driver.find_element(By.ID, "total-lag").text == "0", "after a reset to latest the lag is 0")

        driver.get(BASE + f"/topics/{TOPIC}")
        go(driver, driver.find_element(By.PARTIAL_LINK_TEXT, "Delete topic"))
        form = driver.find_element(By.ID, "delete-topic")
        form.find_element(By.NAME, "confirm").send_keys("wrong-name")
        go(driver, form.find_element(By.CSS_SELECTOR, "button[type=submit]"))
        check("type the topic name" in driver.find_element(By.CLASS_NAME, "error").text, "a wrong confirmation is refused")
        form = driver.find_element(By.ID, "delete-topic")
        form.find_element(By.NAME, "confirm").send_keys(TOPIC)
        go(driver, form.find_element(By.CSS_SELECTOR, "button[type=submit]"))
        wait.until(ec.presence_of_element_located((By.CLASS_NAME, "notice")))
        check(f"Deleted topic {TOPIC}" in driver.find_element(By.CLASS_NAME, "notice").text, "the topic is deleted after confirmation")
        shot(driver, "deleted")
    finally:
        driver.quit()


main()
