#!/usr/bin/env python3
"""A do-nothing OTLP/HTTP collector for benchmarks: answers every POST /v1/traces with 200 and
an empty ExportTraceServiceResponse (an empty protobuf message), and logs each export's size.
Listens on 127.0.0.1, on a free port; prints `listening on http://127.0.0.1:PORT` first."""
import http.server
import sys


class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        n = int(self.headers.get("content-length", "0"))
        self.rfile.read(n)
        self.send_response(200 if self.path == "/v1/traces" else 404)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
        print(f"export {self.path} {n} bytes", flush=True)

    def log_message(self, *args):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(f"listening on http://127.0.0.1:{server.server_address[1]}", flush=True)
try:
    server.serve_forever()
except KeyboardInterrupt:
    sys.exit(0)
