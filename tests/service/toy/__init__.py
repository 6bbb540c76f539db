"""A task that exists for a test only (test_layout.py): what adding a task takes, shown by adding one."""
