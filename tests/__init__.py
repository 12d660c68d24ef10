"""The test suites, one package per package under test, and their shared support (:mod:`tests.support`)."""
