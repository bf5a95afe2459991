mod schedules;
