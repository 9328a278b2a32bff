"""What the tests, the benchmarks and the demo start: real sidecars and torchrun jobs (`job`,
`processes`), simulated nodes of one job on this machine (`cluster`, `netns`, `node_clock.c`), and
the test suite's warm servers that fork agents and sidecars with their imports done (`zygote`,
`zygote_ranks`, `warm_server`)."""
