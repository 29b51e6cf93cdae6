"""autopar's release, in the foundation floor so that any package may state it (the HTML
report's footer) without importing the top-level package."""

__version__ = "0.1.0"
