"""The sandbox: untrusted code run in isolation (openrl_lab/sandbox/)."""
