"""Room 4, the kopf wiring and `warmfleet operator` command; imports every room below, and no room imports it."""
