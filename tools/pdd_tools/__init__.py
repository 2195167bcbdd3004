"""Tools around pdd-wire (benchmarks, demo, harness); not part of the agent."""
