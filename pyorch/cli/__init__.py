"""The `pyorch` command line: `pyorch serve ...` and
`pyorch bench {throughput,latency,startup,serve,attention}`."""
