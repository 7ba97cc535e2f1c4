import os

# The simulated device unless the sweep asks for the real one (CAPSAFE_BACKEND=cuda on a GPU).
# Set here, before any test (or the plugin's neighbour threads) creates the driver.
os.environ.setdefault("CAPSAFE_BACKEND", "sim")
