"""What several benchmark subjects and the tests share: real `kvsieve serve` and redis-server
processes on free loopback ports, real text for the real model, PNG plots of the results."""
