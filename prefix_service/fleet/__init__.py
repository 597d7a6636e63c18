"""The fleet: one prefix service in front of many engines (each with its own gateway), the routing
policies that pick an engine per request, and what the fleet reports."""
