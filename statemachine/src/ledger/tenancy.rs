//! Tenancy (org → project → user) and the versioned price table.

use super::{Books, OrgRec, PriceTable, ProjectRec, UserRec};
use crate::command::Quota;
use crate::ids::{GpuType, OrgId, ProjectId, UserId};
use crate::limits::*;
use crate::outcome::{CommandError, Limit, QuotaKind};
use std::collections::BTreeMap;

// Ids, GPU type names and prices are checked by `crate::validate` before apply
// dispatches a command here.

impl Books {
    pub(crate) fn create_org(&mut self, org: OrgId) -> Result<(), CommandError> {
        if self.orgs.contains_key(&org) {
            return Err(CommandError::AlreadyExists);
        }
        if self.orgs.len() >= ORGS_MAX {
            return Err(CommandError::LimitReached(Limit::Orgs));
        }
        self.orgs.insert(org, OrgRec::default());
        Ok(())
    }

    pub(crate) fn create_project(
        &mut self,
        project: ProjectId,
        org: OrgId,
        quota: &Quota,
    ) -> Result<(), CommandError> {
        let rec = self.orgs.get(&org).ok_or(CommandError::UnknownOrg)?;
        if rec.projects.contains(&project) {
            return Err(CommandError::AlreadyExists);
        }
        if rec.projects.len() >= quota.projects_max as usize {
            return Err(CommandError::QuotaExceeded(QuotaKind::Projects));
        }
        if self.projects.len() >= PROJECTS_MAX {
            return Err(CommandError::LimitReached(Limit::Projects));
        }
        self.projects.insert(
            (org, project),
            ProjectRec {
                org,
                account: Default::default(),
            },
        );
        if let Some(rec) = self.orgs.get_mut(&org) {
            rec.projects.insert(project);
        }
        Ok(())
    }

    pub(crate) fn create_user(
        &mut self,
        user: UserId,
        org: OrgId,
        quota: &Quota,
    ) -> Result<(), CommandError> {
        let rec = self.orgs.get(&org).ok_or(CommandError::UnknownOrg)?;
        if rec.users.contains(&user) {
            return Err(CommandError::AlreadyExists);
        }
        if rec.users.len() >= quota.users_max as usize {
            return Err(CommandError::QuotaExceeded(QuotaKind::Users));
        }
        if self.users.len() >= USERS_MAX {
            return Err(CommandError::LimitReached(Limit::Users));
        }
        self.users.insert(
            (org, user),
            UserRec {
                org,
                usage: Default::default(),
                budget: None,
            },
        );
        if let Some(rec) = self.orgs.get_mut(&org) {
            rec.users.insert(user);
        }
        Ok(())
    }

    /// Replaces the price table with a new version. Running work keeps the price fixed
    /// on its meter at placement; only later placements see the new prices.
    pub(crate) fn set_prices(
        &mut self,
        now: u64,
        prices: &[(GpuType, u64)],
    ) -> Result<u32, CommandError> {
        let version = self
            .prices
            .version
            .checked_add(1)
            .ok_or(CommandError::Overflow)?;
        self.prices = PriceTable {
            version,
            since_ms: now,
            prices: prices.iter().cloned().collect::<BTreeMap<_, _>>(),
        };
        Ok(version)
    }

    pub fn price_of(&self, gpu_type: &GpuType) -> Option<u64> {
        self.prices.prices.get(gpu_type).copied()
    }
}
