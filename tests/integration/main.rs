mod torch;
