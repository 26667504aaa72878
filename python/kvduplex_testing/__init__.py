"""The test and benchmark harness of kvduplex: what tests and benchmarks add to the servers and
tiny models of `kvduplex.demo`. A source-checkout package; the wheel installs only `kvduplex`."""
