"""A third-party vendor plugin, installed with pip by opdispatch's tests."""
