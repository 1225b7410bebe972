"""Moving series through trees and upstream: apply into a user's tree, export back, the signals that
say a base has a fix, rebase, status, port, pick, target add, watch, the carrying-cost report, and
upstream PR texts and policy.
"""
