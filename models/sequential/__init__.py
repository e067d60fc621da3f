"""Next-item recommendation on positive-only sequence logs (leave-one-out): the user model's next-item
objective, the SASRec and popularity baselines, and the ranking evaluation shared by all of them."""
