mod views;
