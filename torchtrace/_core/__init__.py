"""Options and the types every layer shares: the resolved configuration, calls as columns, schedules, ranks."""
