"""What the tests and benchmarks use and the servers do not: never imported by the package itself."""
