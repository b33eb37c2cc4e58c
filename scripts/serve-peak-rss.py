#!/usr/bin/env python3
"""serve-peak-rss.py: the peak resident memory of `coli serve` after one large request.

Starts `COLI serve --port 0 SNAP=<a copy of fixtures/olmoe_trained> 64 16 16 USAGE_SAVE=0
[EXTRA ...]`, sends one `Content-Type: application/json` body of English prose just under
the 4 MiB body limit (3.9 MB) to ENDPOINT (`/v1/chat/completions`, `/v1/completions` or
`/tokenize`), and prints the answer's status, its time and the server's VmHWM (peak resident
set, from /proc/<pid>/status) before and after. Linux only; only the standard library.

    serve-peak-rss.py target/debug/coli /v1/chat/completions [LONG_CONTEXT=1 ...]
"""

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "olmoe_trained")
PARAGRAPH = ("The river rose in the spring and the town moved its market to the hill, "
             "where the old church stood; merchants came from the coast with salt and cloth. ")


def peak_mb(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no VmHWM in /proc/<pid>/status")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    binary, endpoint, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    work = tempfile.mkdtemp()
    snap = os.path.join(work, "olmoe_trained")
    shutil.copytree(FIXTURE, snap)
    server = subprocess.Popen(
        [binary, "serve", "--port", "0", f"SNAP={snap}", "64", "16", "16", "USAGE_SAVE=0", *extra],
        stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in server.stderr:
            found = re.search(r" on http://127\.0\.0\.1:(\d+)/", line)
            if found:
                port = int(found.group(1))
                break
        if port is None:
            sys.exit("coli serve did not start")
        before = peak_mb(server.pid)
        text = PARAGRAPH * (3_900_000 // len(PARAGRAPH))
        if endpoint == "/v1/chat/completions":
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
        elif endpoint == "/v1/completions":
            body = {"prompt": text, "max_tokens": 1}
        else:
            body = {"content": text}
        payload = json.dumps(body).encode()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        started = time.time()
        connection.request("POST", endpoint, payload, {"Content-Type": "application/json"})
        answer = connection.getresponse()
        answer.read()
        print(f"{endpoint}: {len(payload) / 1e6:.2f} MB -> {answer.status} in "
              f"{time.time() - started:.1f} s | VmHWM {before} MB before, {peak_mb(server.pid)} MB after")
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
